"""The demo model's task, trainer (`python -m kevscore.demo.train`) and tokenizer; the runtime never imports this."""
