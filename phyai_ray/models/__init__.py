"""Built-in plugins: the reference parallel transformer and the MiniLM sentence encoder."""
