"""The host runtime: Model and LM over the C engine (the _engine binding), where its C sources are,
and the tokenizers."""
