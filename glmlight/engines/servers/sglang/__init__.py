"""The SGLang backend of the server fleet: `engine.py` (`SGLangEngine`: the fleet of SGLang servers and
its start-up checks), `adapter.py` (`SGLangServer`: one server's requests), `sync.py` (`SGLangWeightSync`:
its weight-sync transport) and `wire.py` (answers, request ids, tensors for /update_weights_from_tensor)."""
