"""Who the replicas are (``Replica``) and how values travel between them outside a step's own
program: coalesced sums, broadcasts and gathers over the replicas' process group (``Replica.group``).

The bottom wing: it imports no other wing (``_internals`` at most). It re-exports nothing.
"""
