"""People in the loop: the chat page where a person asks, judges and hints (``chat``), the on-device store of their
conversations (``store``, SQLite) and the client round that trains on them (``replay``).
"""
