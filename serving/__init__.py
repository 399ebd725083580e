"""The LLM server: the three managers, the HTTP app, topologies and the CLI."""
