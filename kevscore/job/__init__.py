"""A job from input to output: the input scan, file formats, windows, resumable parts, shards, ranks."""
