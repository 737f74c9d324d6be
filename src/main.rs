fn main() {
    println!("llama-graph");
}
