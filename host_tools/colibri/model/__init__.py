"""The model: the image format's constants and records (format), the in-memory graph (ir) and the
errors every layer raises. Layer: imports the standard library and numpy only."""
