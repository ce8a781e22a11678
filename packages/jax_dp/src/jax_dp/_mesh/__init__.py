"""The device mesh (``mesh``) and how variables lie on it (``layout``). A bottom wing: it imports no
other wing.
"""
