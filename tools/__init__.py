"""Tools that run beside the server and talk to it as a client (``tools.soak``)."""
