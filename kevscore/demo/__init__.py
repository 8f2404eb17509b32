"""The demo model's task and trainer (`python -m kevscore.demo.train`); the runtime never imports this."""
