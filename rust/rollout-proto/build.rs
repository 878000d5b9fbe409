//! Compiles `proto/agent.proto` with protox (a protobuf compiler in pure Rust), so building needs
//! no `protoc` installed on the machine, then generates the tonic client and server.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/agent.proto");
    let descriptors = protox::compile(["proto/agent.proto"], ["proto"])?;
    tonic_build::configure().build_client(true).build_server(true).compile_fds(descriptors)?;
    Ok(())
}
