"""The engine: everything that turns requests into tokens inside one device group.

`Sequence` (one request's state), `Scheduler` (who computes how many tokens each step),
`ModelRunner` (the device, the KV tensors, one forward pass per step), the models, the
sampler, the detokenizer, tensor parallelism (`parallel/`), and `Engine` that steps them;
`LLM` is the offline API over it. The engine knows nothing of Celery, Redis streams or the
database: the device-group service in `workers/` drives it.
"""
