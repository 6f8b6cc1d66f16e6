"""One model sharded over several processes (``troupe serve --distributed``, under
``mlx.launch``): rank 0 serves, every other rank follows.

Every rank loads its shard with mlx-lm's ``sharded_load`` (tensor parallel, or pipeline) and
runs the same ``Engine``. Rank 0 runs the whole server; the model's own collectives exchange
activations inside each forward pass, so every rank must run the same forward pass at the same
time. Rank 0's scheduler therefore tells the followers, over a TCP side channel, everything
that changes the batch, in order: a request added (its tokens, sampling, output spec and
grammar source), a request aborted, and each step's plan (``schedule``'s decisions, which
depend on rank 0's clock and memory). A follower applies them to its own engine and runs the
step; its sampled tokens are the same as rank 0's (the same logits, the same seeded PRNG), and
a digest of each step's tokens, sent back, proves it.

The prefix cache is per rank: each rank cuts, keeps and writes its own shard of every block,
under a directory of its own (``rank_cache_dir``). A hit must be a hit on every rank, so rank 0
asks the followers how many of a prompt's cached blocks they can supply (``Probe``), takes as
many as every rank can (``combine``), and names them in the ``Add``; each follower holds what it
offered until then (actors/follower_cache.py).

The package, in layers: ``protocol`` (the channel's messages, frames, handshake and secret),
``shards`` (the modes, each rank's memory shape, cache directory and shard loading),
``leader`` (rank 0's side: ``Followers``), ``follower`` (a follower's connection and step
loop) and ``launch`` (starting a rank). It imports no actor and nothing of the serving layer:
the wiring passes in what it needs.
"""
