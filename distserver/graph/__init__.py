"""distserver.graph."""
