"""The conformance suite's parts (private: the public names are re-exported by ``streamkl_ref.testing``)."""
