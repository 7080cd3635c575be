"""HAProxy's agent check: what this node tells the balancer in front of a pool.

``weight`` computes the answer (sans-IO, plain arithmetic); ``listener`` serves it on
``server.agent_listen``. See docs/operations.md, "The agent check".
"""
