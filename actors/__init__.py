"""Actors that own the runtime's state; each is driven by typed messages."""
