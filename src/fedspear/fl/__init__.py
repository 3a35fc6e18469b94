"""The federated layer on Flower: the only package of fedspear that imports ``flwr`` / ``flwr_datasets``.

- ``partition``: Dirichlet split of a task's train set over its gold answers (flwr-datasets).
- ``strategy``: win-weighted FedAvg with the zero-win guard (SPEC §4) on Flower's message API.
- ``client_app`` / ``server_app``: the ClientApp and ServerApp (``flwr run .`` uses them, see pyproject.toml).
- ``simulation``: runs both on Flower's simulation engine on one machine (what ``fedspear run`` does).
"""
