//! What connects the fleet to systems beside it: the external router's worker list (smg) and
//! the engines' load reports the capacity router reads.

pub mod loads;
pub mod smg;
