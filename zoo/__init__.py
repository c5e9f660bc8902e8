"""Model zoo: acquire the target, build corpora, train and evaluate drafts."""
