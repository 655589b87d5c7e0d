"""`python -m mlx_engine launch AGENT`: a coding agent (claude, codex, opencode, qwen, aider) started against this
server with its configuration for this run only. agents.py: what each agent is given; server.py: the server
found on the port or started and stopped with the agent; command.py: the command."""
