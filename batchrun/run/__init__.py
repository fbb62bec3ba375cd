"""ONE RUN: the parent process, the worker processes, and what passes between them."""
