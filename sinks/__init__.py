"""kvbus sinks stage."""
