"""The indexer's Hopper (sm_90) Gluon forward (``fwd_sm90``): the chunk design's storing forward for
wide MQA teachers by default, the plain and accumulating forwards when forced."""
