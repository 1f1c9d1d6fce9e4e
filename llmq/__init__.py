"""The top floor: the `llmq` command and the all-in-one launcher (`llmq up`).

This package may import every layer below it (the contract in `tasks/`, the web app in
`webapp/`, the device-group service in `workers/`); nothing below imports it.
"""
