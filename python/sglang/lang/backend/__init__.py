"""Backends the interpreter runs programs on: an HTTP server (RuntimeEndpoint) or an
in-process Engine (EngineBackend). Both speak the same /generate bodies."""
