"""moelab HTTP API (FastAPI). Thin adapter around ``moelab.engine``; never runs torch in a request."""
