"""Bridges from model libraries to attnperf; each imports its library only when used."""
