"""The Kev layers: gated DeltaNet, gated attention, the blocks they share and the ops interface they call."""
