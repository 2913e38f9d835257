"""Integrations with training frameworks (nanotron, Accelerate): each adapts the framework's own
configuration and schedule to the Provisioner, and is imported only by users of that framework."""
