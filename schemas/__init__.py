"""kvbus's contract: the event model, its Avro schemas, topic names and settings.

Every stage (producers, streams, sinks) and every external consumer shares
only what is defined here.
"""
