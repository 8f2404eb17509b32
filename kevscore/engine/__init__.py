"""The engine: prefill and scoring over the state bank, the runners and graphs, the bank and its store."""
