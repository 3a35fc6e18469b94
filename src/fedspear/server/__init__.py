"""Server maths, no ``flwr``: the weighted and robust averages of client adapters (``aggregation``), the server
optimisers FedAdam / FedYogi (``server_opt``), the per-round client learning rate (``schedule``) and the checks every
client reply passes before it is averaged (``validation``). ``fedspear.fl.strategy`` calls them from Flower.
"""
