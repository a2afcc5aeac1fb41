use super::*;

#[test]
fn constant_group_dequantizes_exactly() {
    let x = vec![0.375f32; 64];
    for f in ["q4_tok", "q2_tok@head"] {
        let format: Format = f.parse().unwrap();
        let mut row = vec![0u8; format.row_bytes(64)];
        let mut params = vec![0u8; format.params_bytes(1, 64)];
        quantize_row(format, &x, &mut row, &mut params);
        let mut out = vec![0f32; 64];
        dequantize_row(format, &row, &params, &mut out);
        assert_eq!(out, x, "{f}");
        assert_eq!(get_f16(&params, 0), 0.0, "{f}: scale");
    }
}
