"""A job's event stream in Redis: `publish` writes it (the worker's per-step EVAL, beat's
restart events), `reader` replays and follows it, `live_hub` shares one pub/sub connection
among every live subscriber of a web process."""
