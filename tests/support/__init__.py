"""Code the tests and `make bench` share: checkpoint builders, references, stand-ins."""
