"""In-package fakes: a scripted OpenAI-compatible model and local stand-ins for the web."""
