"""Built-in plugins: the reference parallel transformer, the reference token model, the MiniLM sentence
encoder and the example robot policy (`reference_policy`)."""
