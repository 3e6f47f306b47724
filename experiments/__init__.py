"""The seeds' experiments: scripts that write PNG + JSON."""
