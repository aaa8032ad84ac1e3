"""kvbus serve: the HTTP query service."""
