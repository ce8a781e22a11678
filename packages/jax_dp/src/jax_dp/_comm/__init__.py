"""How values travel between processes outside a step's own program: process 0's decisions on every
process, and host copies of arrays on the mesh (``hosts``). A bottom wing: it imports no other wing.
"""
