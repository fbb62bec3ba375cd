"""A real llama.cpp ``llama-server`` for the tests: a tiny scripted GGUF model and the server's lifecycle."""
