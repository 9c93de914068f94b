"""Serving: the command line, and (later) the engine and the chat REPL."""
