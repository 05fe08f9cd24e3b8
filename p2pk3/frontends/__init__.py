"""Front ends over the client library (`p2pk3.node.client`): the one prompt path of every front end
(`prompt.py`: messages -> prompt ids, stop ids, sampling with the checkpoint's defaults), the chat REPL
(`repl.py`) and the data of the cluster dashboard (`cluster_view.py`). No click here: the commands in
`p2pk3/cli/` wrap these."""
