"""`llmq bench`: a serving benchmark client that speaks `vllm bench serve`.

Same flags, datasets, metric definitions, printed table and JSON keys as vLLM's
`vllm bench serve`, so llmq can be put beside the servers users run today. A client only:
it imports nothing of the server and runs against any OpenAI-compatible endpoint
(`--backend openai|openai-chat`) or llmq's durable jobs API (`--backend llmq-jobs`).

One concept per module: `args` (the flags), `datasets` and `prompts` (what is sent),
`arrivals` (when it is sent), `backends` and `sse` (how one request is timed),
`runner` (dispatch under a rate and a concurrency limit), `metrics` and `report`
(vLLM's numbers, table and JSON), `main` (the command).
"""
