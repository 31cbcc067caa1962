"""Expert parallelism: dispatch, combine and count exchanges per MoE layer, the load
imbalance and the balanced-routing what-if."""
