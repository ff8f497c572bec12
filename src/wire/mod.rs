//! Wire formats. Each format module parses its API's request body without
//! loss, shows the pipeline its conversation as a chat-shaped message list
//! (the view the stages, the plan, the budget and the stores work on), and
//! writes the pipeline's decisions back into its own body, rewriting only
//! the parts that changed. Chat completions is the view itself.

pub mod anthropic;
