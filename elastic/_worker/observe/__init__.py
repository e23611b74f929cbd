"""What a run says about itself: the event log, metrics, progress, the per-step report and costs, replica digests."""
