"""Server maths, no ``flwr``: the win-weighted and fixed-denominator averages of client adapters and the
pseudo-gradient (``aggregation``; the robust rules are Flower's, called from ``fedspear.fl.strategy``), the server
optimisers FedAdam / FedYogi (``server_opt``), the per-round client learning rate (``schedule``) and the checks every
client reply passes before it is averaged (``validation``). ``fedspear.fl.strategy`` calls them from Flower.
"""
