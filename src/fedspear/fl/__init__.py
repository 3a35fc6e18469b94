"""The federated layer on Flower: the only package of fedspear that imports ``flwr`` / ``flwr_datasets``.

- ``strategy``: win-weighted FedAvg with the zero-win guard (SPEC §4) on Flower's message API; ``records``: the
  adapter's wire format.
- ``client_app`` / ``server_app``: the ClientApp and ServerApp (``flwr run .`` uses them, see pyproject.toml).
- ``simulation``: runs both on Flower's simulation engine on one machine (what ``fedspear run`` does).
- ``node_worker``: a deployed node's process that keeps the model across rounds; ``certs``: its TLS certificates and
  SuperNode keys (no Flower import of its own).
- ``partition``: Dirichlet split of a task's train set over its gold answers (flwr-datasets).
- ``privacy``: central differential privacy on Flower's DP wrappers.
- ``secagg``: secure aggregation on Flower's SecAgg+ (its legacy workflow, a legacy Strategy and ClientApp).
"""
