"""Where inputs come from: model folders or aliases, text files or the embedded Wikipedia text."""
