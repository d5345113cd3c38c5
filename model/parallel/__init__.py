"""Tensor and data parallelism inside the model: a rank's place and collectives (``context``), the
modules of a rank's share (``modules``) and the rewrite of a whole model into that share (``sharding``)."""
