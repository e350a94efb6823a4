"""distserver.transports."""
