"""The guest agent, its wire protocol, and the host's side of the conversation."""
